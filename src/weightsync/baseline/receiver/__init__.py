"""The broadcast baseline's receiver half: each rollout rank joins the trainer's group,
receives every bucket whole and loads it tensor by tensor."""
