# one-off after the review refactor (wq_operands): designs (e) and (f) bit-equal to (a) at ragged cases, zeros when empty
import torch, sys
sys.path.insert(0, "benchmarks")
from cuda_wq_cluster import cuda_grouped_mm_wq_fwd
from gluon_wq_tma import gluon_grouped_mm_wq_tma_fwd as efwd
from mxmoe.ops.gemm import grouped_mm_nt
from mxmoe.ops.quantize import fake_quantize
from mxmoe.recipe import get_recipe
r = get_recipe("mxfp8"); bf = torch.bfloat16
for (T, K, N, sizes) in [(4000, 1408, 64, [162, 0, 2577, 446, 0, 83]), (2000, 1416, 264, [257, 1000, 700]), (0, 64, 64, [0, 0])]:
    x = torch.randn(T, K, device="cuda", dtype=bf); w = (torch.randn(len(sizes), N, K, device="cuda") * 0.02).to(bf)
    o = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    xq = fake_quantize(x, r, dim=1, out_dtype=bf)
    ref = grouped_mm_nt(xq, fake_quantize(w, r, dim=2, out_dtype=bf), o)
    for name, fn in (("e", efwd), ("f", cuda_grouped_mm_wq_fwd)):
        out = fn(xq, w, o)
        print(name, T, K, N, "bit-equal", bool((out.view(torch.int16) == ref.view(torch.int16)).all()), tuple(out.shape))
