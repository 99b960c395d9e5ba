"""Custom (non-Hugging Face) models for `module:function` sources: a CNN and an LSTM language model.

    memfit estimate memfit.examples.convnet:build --inputs memfit.examples.convnet:make_inputs
"""
