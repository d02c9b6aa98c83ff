"""The prompt: OpenAI messages, images and videos -> ``Prompt`` (token ids with expanded media spans).

``preprocess`` (``Preprocessor``: the chat template, the tokenizer and the image processor of the
checkpoint; ``Prompt``, ``ImageItem``), ``placeholders`` (expanding each image or video token into its
item's span), ``images`` (strict decoding of client images), ``videos`` (client
videos: parts, sampling options, the video stage), ``media`` (remote images and videos from allow-listed
hosts), ``text_limits`` (refusing text that cannot fit the context before tokenizing it) and ``workers``
(the bounded thread pools the text and image stages run on).

May import ``backends`` (``media`` resolves hosts with ``backends.discovery``) and the shared modules
(``errors``, ``faults``); never ``openai``, ``web``, ``dispatch`` or the shell. Layers:
``services/proxy/__init__.py``.
"""
