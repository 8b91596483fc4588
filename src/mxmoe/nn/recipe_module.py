"""The recipe attribute shared by mxmoe's modules."""

from __future__ import annotations

from ..recipe import Recipe, get_recipe


class RecipeModule:
    """Mixin for a module whose GEMMs follow a :class:`~mxmoe.recipe.Recipe` (kept in
    ``_recipe``): the ``recipe`` property and :meth:`set_recipe`, which
    :func:`mxmoe.convert_to_mxfp8` calls. Subclasses add their own checks in
    :meth:`_check_recipe`."""

    _recipe: Recipe

    @property
    def recipe(self) -> Recipe:
        """The :class:`~mxmoe.recipe.Recipe` of the module's GEMMs; assigning a recipe or its
        name calls :meth:`set_recipe`."""
        return self._recipe

    @recipe.setter
    def recipe(self, recipe: Recipe | str) -> None:
        self.set_recipe(recipe)

    def set_recipe(self, recipe: Recipe | str):
        """Run the module's GEMMs under ``recipe`` from the next forward on; returns self.
        Parameters and state_dict are unchanged.

        Raises:
            ValueError: unknown recipe, or one the module refuses (:meth:`_check_recipe`).
        """
        recipe = get_recipe(recipe)
        self._check_recipe(recipe)
        self._recipe = recipe
        return self

    def _check_recipe(self, recipe: Recipe) -> None:
        """Raise ValueError if the module cannot run ``recipe`` (default: any recipe)."""
