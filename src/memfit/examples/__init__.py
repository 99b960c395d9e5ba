"""Custom (non-Hugging Face) models for `module:function` sources: a CNN, an LSTM language model and a
classifier on a partly frozen encoder.

    memfit estimate memfit.examples.convnet:build --inputs memfit.examples.convnet:make_inputs
"""
