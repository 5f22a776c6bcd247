"""The admission webhook: bounds on a review before it is parsed, the server's connection limits, the claim check."""
