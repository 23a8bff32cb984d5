"""The fleet: which upstream members exist, which of them take traffic, and who gets the next request.

  discovery.py      pool members from static lists and DNS, re-resolved in the background
  health.py         active probes (a circuit breaker per upstream) and the seam to outlier detection
  outlier.py        Envoy-style outlier detection per pool (ejection by the request path's outcomes, panic)
  pools.py          the prefill pool: prefix-affinity choice, failover across members; `member_serving`
  gate.py           the express gate: leases on express nodes, bounded FIFO queue
  capabilities.py   what each lane's nodes can honour (a node's GET /capabilities), capability routing
"""
