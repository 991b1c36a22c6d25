"""Which replica of a stage serves a request: the policies, the prefix index of each entry replica's
held blocks, the block hashes it is keyed by, and session affinity."""
