"""One job's reconcile pass, the status it writes, where it reads its job, and the queue and tasks that run passes."""
