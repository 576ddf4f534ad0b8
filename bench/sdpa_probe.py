"""Which SDPA kernel serves Mosaic's attention shapes on this GPU, and how fast (a diagnostic)."""
import json
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

res = {"cudnn_version": torch.backends.cudnn.version()}
for n in (8192, 32768):
    for layout in ("stacked", "contiguous"):
        q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(n, 32, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(n, 32, 128, device="cuda", dtype=torch.bfloat16)
        kk, vv = (k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        if layout == "contiguous":
            kk, vv = kk.contiguous(), vv.contiguous()
        for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            key = f"{n}/{layout}/{name}"
            try:
                with warnings.catch_warnings(record=True) as w, sdpa_kernel([be]):
                    warnings.simplefilter("always")
                    F.scaled_dot_product_attention(q, kk, vv)
                    torch.cuda.synchronize()
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    for _ in range(3):
                        F.scaled_dot_product_attention(q, kk, vv)
                    e.record()
                    torch.cuda.synchronize()
                res[key] = {"ms": s.elapsed_time(e) / 3, "warnings": [str(x.message)[:300] for x in w]}
            except RuntimeError as ex:
                res[key] = {"error": str(ex)[:600], "warnings": [str(x.message)[:300] for x in w]}
            print(key, res[key], flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
