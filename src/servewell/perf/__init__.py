"""Performance tools: `servewell bench` (a load generator and sweep against any OIP v2 server)
and `servewell tune` (measures candidate settings of one model and recommends the best within
a p99 SLO). Nothing here is imported by the server; the server is what these tools measure.
"""
