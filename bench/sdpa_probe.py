"""Which SDPA kernel serves Mosaic's attention layouts on this GPU, and how fast (a diagnostic):
q contiguous or a strided view (as Mosaic's [N, H, hd] rows viewed as [1, H, N, hd]), K/V strided,
each backend alone, so that a kernel that declines a layout shows as an error."""
import json
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

res = {"cudnn_version": torch.backends.cudnn.version(), "torch": torch.__version__}
for n in (8192, 32768):
    for layout in ("q_strided", "q_contiguous"):
        q = torch.randn(n, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(0, 1)[None]
        if layout == "q_contiguous":
            q = q.contiguous()
        k = torch.randn(n, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(0, 1)[None]
        v = torch.randn(n, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(0, 1)[None]
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            key = f"{n}/{layout}/{name}"
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                try:
                    with sdpa_kernel([be]):
                        F.scaled_dot_product_attention(q, k, v)
                        torch.cuda.synchronize()
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        for _ in range(3):
                            F.scaled_dot_product_attention(q, k, v)
                        e.record()
                        torch.cuda.synchronize()
                    res[key] = {"ms": s.elapsed_time(e) / 3}
                except RuntimeError as ex:
                    res[key] = {"error": str(ex)[:400]}
                res[key]["warnings"] = [str(x.message)[:400] for x in w]
            print(key, res[key], flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
