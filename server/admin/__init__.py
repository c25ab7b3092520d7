"""The operators' routes: live stats, Prometheus metrics, the OpenAPI document."""
