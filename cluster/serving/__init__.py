"""The Ray Serve plumbing: worker deployments' common base, replica routing,
GPU gang discovery, and the messages workers and the router exchange."""
