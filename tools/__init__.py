"""relaygr.tools: traffic and measurement around the cascade (traces, replay, local deployments,
experiments, reports). Nothing in the cascade imports it."""
