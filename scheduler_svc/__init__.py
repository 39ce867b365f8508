"""The scheduler service: tensor-parallel ranks that run the model.

Rank 0 serves gRPC and plans each step; every rank runs the same plan
(DESIGN.md §6). Modules: `settings` (what can be configured), `errors`,
`plan` (what crosses ranks), `collective` (the only torch.distributed calls),
`agreement` (the one per-step failure vote), `reader` (materializing
TensorRefs), `engine` (one step on one rank), `loop` (rank 0's step thread),
`frontend` (admission and streams), `group` (starting and watching a local
group's ranks), `ranks` (bootstrapping a rank),
`server` (the gRPC servicer and process lifecycle).
"""
