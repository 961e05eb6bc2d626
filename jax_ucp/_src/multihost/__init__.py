"""What several processes need to work as one: identity and liveness of peers, and the exchange
through which they agree on a step."""
