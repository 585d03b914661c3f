"""Phase 5's benchmark side: the load-generating client and its workloads, the serving exercises'
view of a server, the plain-PyTorch baseline the engine must beat, and the tensor-parallel worker."""
