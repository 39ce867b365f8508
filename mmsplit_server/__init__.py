"""What the two services share and a client never needs: the hand-off of
pixel tensors (shared-memory naming and validation, the slab, the tensor
reference codec, the CUDA-IPC device backends), the model families' rules
for items, sampling parameters, settings and serving helpers (security,
health, stop signals), the LRU and the metrics registry.

It ships in the server distribution (`mmsplit`); the contract, the error
mapping and the client are the light client distribution's `mmsplit`
package. The two services (`tokenizer_svc`, `scheduler_svc`) import from
both and never from each other.
"""
