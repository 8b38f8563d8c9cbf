"""HTTP serving: OpenAI-compatible and KServe front ends over one engine per Ray Serve replica."""
