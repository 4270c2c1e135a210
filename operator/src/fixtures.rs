//! Test fixtures: a scripted Kubernetes API and a fake admin API.
