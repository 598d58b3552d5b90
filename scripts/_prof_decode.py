import torch, numpy as np, sys
sys.path.insert(0, '.')
import pyattn
from pyattn.ops._paged import check_pools, check_query
from pyattn.ops.decode import run_decode
dev = pyattn.get_device(); s = pyattn.runtime.stream.default_stream(dev)
Hq,Hkv,D=32,8,128
for B,L,ps,splits in [(8,32768,16,6)]:
    npages=B*L//ps
    k=torch.randn(npages,ps,Hkv,D,device='cuda',dtype=torch.bfloat16); v=torch.randn_like(k)
    perm=torch.randperm(npages,device='cuda').int().reshape(B,L//ps)
    q=torch.randn(B,1,Hq,D,device='cuda',dtype=torch.bfloat16)
    dq,dk,dv,dt=(pyattn.asarray(x) for x in (q,k,v,perm))
    dl=pyattn.asarray(np.full(B,L,np.int32))
    pool=check_pools(dk,dv)
    P=check_query(dq,pool,causal=True,window=None,softcap=None,alibi_slopes=None,scale=None,num_splits=splits)
    for _ in range(3): run_decode(P,pool,dq,dk,dv,(dt,None,L//ps,dl),L,None,s,False)
    s.synchronize()
