"""Fleet planning: `servewell plan` sizes a fleet from a model's measured curve, and a simulator
(request-level for what can be checked against real replicas, fluid for a day at 100,000 req/s)
shows what traffic shapes, faults and autoscaling policies do to it.

A package of its own beside `servewell`, shipped in the same distribution and usable with the `plan`
extra (`pip install 'servewell[plan]'`): the server never imports it (only the CLI's `servewell plan`
dispatch does), and it imports nothing of the server's but `servewell.perf.report` (tables, JSON).
"""
