"""gaudi-serve's Kubernetes operator: InferenceService -> Gaudi pods with an honest status."""
