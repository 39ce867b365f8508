"""The hand-off of pixel tensors from the tokenizer to the scheduler's ranks:
one interface (`reference`) over four transports, each a module of its own
that imports none of the others (`inline`, `segment`, `slab`, `cuda_ipc`),
on the machinery they share (`files`, `ranges`, `grants`). This package
module imports nothing, so importing any one of them costs only its own."""
