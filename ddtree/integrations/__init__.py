"""ddtree inside other libraries' loops: ``generate(custom_generate=ddtree.decoding(...))`` in transformers."""
