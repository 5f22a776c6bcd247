"""Kubernetes backend: kopf handlers (`handlers`), the reconcile loop (`reconcile`), pure manifest builders
(`manifests`), observation of pods and nodes (`observe`), and `main(argv)` behind `seqtrain operator`.

Only `handlers`/`main` import kopf; the builders and observers are pure and import nothing heavy.
"""
