"""The engines behind the gateway: in-process engines, remote replicas, the replica pool and its
prefix affinity."""
