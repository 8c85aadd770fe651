"""The rank processes of a reference replica: rank 0's engine thread (`EngineDriver`), the
follower ranks' command loop, and what every rank runs (`RankRuntime`)."""
