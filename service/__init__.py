"""The serving layer: CLI now; the Ray Serve application (ingress, routing) builds on it."""
