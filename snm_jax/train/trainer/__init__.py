"""One resumable loop for every method (`loop.train_and_evaluate`), the tasks it trains
(classification, retrieval), the data of a run and its orbax checkpoints."""
