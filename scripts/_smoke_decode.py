import torch, numpy as np, time, sys
sys.path.insert(0, '.')
import pyattn, ml_dtypes
from pyattn.runtime.stream import Event
dev = pyattn.get_device(); s = pyattn.runtime.stream.default_stream(dev)
def bench(fn, n=20, reps=5):
    fn(); s.synchronize(); best=1e9
    for _ in range(reps):
        e0=Event(dev, timing=True); e1=Event(dev, timing=True)
        s.record(e0)
        for _ in range(n): fn()
        s.record(e1); e1.synchronize(); best=min(best, e0.elapsed_ms(e1)/n)
    return best*1e3
Hq,Hkv,D=32,8,128
for B,L,ps in [(1,32768,16),(8,4096,16),(64,4096,16),(8,32768,16),(8,4096,4096)]:
    npages=B*L//ps
    k=torch.randn(npages,ps,Hkv,D,device='cuda',dtype=torch.bfloat16); v=torch.randn_like(k)
    perm=torch.randperm(npages,device='cuda').int().reshape(B,L//ps)
    q=torch.randn(B,1,Hq,D,device='cuda',dtype=torch.bfloat16)
    dq,dk,dv,dt=(pyattn.asarray(x) for x in (q,k,v,perm))
    dl=pyattn.asarray(np.full(B,L,np.int32))
    from pyattn.ops._paged import check_pools, check_query
    from pyattn.ops.decode import run_decode
    pool=check_pools(dk,dv)
    for splits in (None, 1, 2, 4, 8, 16, 32):
        P=check_query(dq,pool,causal=True,window=None,softcap=None,alibi_slopes=None,scale=None,num_splits=splits)
        f=lambda: run_decode(P,pool,dq,dk,dv,(dt,None,L//ps,dl),L,None,s,False)
        us=bench(f)
        gb=B*L*Hkv*D*2*2/us/1e3
        print(f"B={B} L={L} ps={ps} splits={splits}: {us:.1f} us, {gb:.0f} GB/s", flush=True)
    del k,v
    torch.cuda.empty_cache()
