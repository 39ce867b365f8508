"""The `mmsplit` command line: the two services, a client, the demo, and the
tiny test model. Reads flags and MMSPLIT_* environment variables in one place
(`config`) and passes settings objects down."""
