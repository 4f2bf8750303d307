import time, torch
from kvcached import core
print("probe:", core.cuda_unavailable_reason(), torch.__version__)
b = core.CudaBackend(0)
print("gran", b.granularity)
t0=time.perf_counter(); r = b.reserve(117<<30); print("reserve 117GiB ms", (time.perf_counter()-t0)*1e3)
L=32; P=2<<20
pt = core.PageTable(b, [(r, 0)], P*2*L, 100)
t0=time.perf_counter(); pt.map([0]); print("map compound us", (time.perf_counter()-t0)*1e6)
t = r.tensor(); print(t.device, t.data_ptr()==r.address)
t[:10] = 3; torch.cuda.synchronize(); print(t[:4].tolist())
pt.unmap([0])
t0=time.perf_counter(); pt.map([0]); print("remap (cache) us", (time.perf_counter()-t0)*1e6, b.stats())
try:
    b.create(1<<50)
except Exception as e: print(type(e).__name__, e)
try:
    b.unmap(r.address + (P*2*L)*50, P)
except Exception as e: print(type(e).__name__, e)
z = core.PageTable(b, [(b.reserve(8<<20), 0)], 2<<20, 4, zero_page=True)
print("zero ok")
pt.close(); z.close(); b.release_cached(); print(b.stats())
f = b.record_fence(torch.cuda.current_stream().cuda_stream); print("fence", b.fence_done(f)); b.release_fence(f)
print("free bytes", b.free_physical_bytes())
