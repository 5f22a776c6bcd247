"""Training progress into the operator: polling rank 0's endpoint, and the push endpoint (tokens: pods/pushauth.py)."""
