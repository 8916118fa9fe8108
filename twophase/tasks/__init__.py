"""Tasks: data, how a batch becomes a model's source, the model, the default reward and the metrics."""
