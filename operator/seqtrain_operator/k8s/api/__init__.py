"""The Kubernetes API as the operator calls it: the client (retries, a request budget), further calls, the finalizer."""
