"""Kubernetes backend: `main(argv)` (main.py) behind `seqtrain operator` builds one frozen `Settings` (settings.py)
and one `Runtime` (process/runtime.py) that kopf's handlers (process/handlers.py) find in their memo; a pass of one job
is `Pass.run()` (passes/reconcile.py) with the job's `JobMemory` (cache/memory.py); pods are built by pure builders
(pods/manifests.py) and observed by pure readers (pods/observe.py). owner.py, below every part, says whose an object
is. docs/architecture.md opens with a map of every module, part by part.

Only `process/handlers` and `main` import kopf (and the webhook's servers, which extend kopf's); the builders and
observers are pure and import nothing heavy.
"""
