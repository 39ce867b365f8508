"""The tokenizer service: client requests in, pixel tensors handed to the
scheduler by reference, streamed text out.

Modules: `settings`, `errors`, `media` (where image bytes come from: inline,
data: URLs, http(s) on the IO thread pool, allowed files), `decode` and
`preprocess` (what runs in a CPU worker), `pool` (the CPU process pool and its
supervisor), `worker` (one worker), `forkserver` (where workers come from),
`prompt` (placeholders, tokens, incremental detokenizing),
`downstream` (the scheduler connection and the transport choice), `service`
(one request end to end), `server` (the servicer and process lifecycle).
"""
