"""The runtime floor every component may use: the distributed context, exit codes, precision,
fault injection and the callback protocol. Imports no other seqtrain package but spec and layout."""
