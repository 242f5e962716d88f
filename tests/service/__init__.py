"""Tests of service/: the ingress, its HTTP, gRPC and OpenAI routes, routing, and the shared service end to end."""
