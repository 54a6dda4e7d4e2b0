"""vllmstack: profiles, checks, build, lifecycle, benchmarks and dashboard for a local vLLM server."""
