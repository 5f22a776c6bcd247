"""Kubernetes backend: `main(argv)` behind `seqtrain operator` builds one frozen `Settings` (settings.py) and one
`Runtime` (runtime.py) that kopf's handlers (handlers.py) find in their memo; a pass of one job is `Pass.run()`
(reconcile.py) with the job's `JobMemory` (memory.py); pods are built by pure builders (manifests.py) and observed by
pure readers (observe.py). docs/architecture.md opens with a map of every module.

Only `handlers`/`main` import kopf; the builders and observers are pure and import nothing heavy.
"""
