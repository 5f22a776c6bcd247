"""The operator process: every process-wide object (Runtime), kopf's handlers, the metrics, a memory diagnostic."""
