"""One declaration per op family (core/op.py): layer_norm (LayerNorm, RMSNorm), softmax
(Softmax, LogSoftmax), relu (ReLU, Add+ReLU), batch_norm (BatchNorm+ReLU, +Add+ReLU)."""
