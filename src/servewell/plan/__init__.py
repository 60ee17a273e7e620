"""Fleet planning: `servewell plan` sizes a fleet from a model's measured curve, and a simulator
(request-level for what can be checked against real replicas, fluid for a day at 100,000 req/s)
shows what traffic shapes, faults and autoscaling policies do to it."""
