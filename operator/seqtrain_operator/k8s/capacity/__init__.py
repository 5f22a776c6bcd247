"""Native gang admission: node capacity kept one pod event at a time, other tenants' pods, reservations, the cycle."""
