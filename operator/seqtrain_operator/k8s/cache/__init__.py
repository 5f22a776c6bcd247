"""What the operator keeps in memory instead of asking the API: pod and node mirrors, projections, each job's memory."""
