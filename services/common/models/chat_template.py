"""Chat formats as Jinja templates for the built checkpoints: llava-1.5's, Qwen2-VL's and Qwen3-VL's.

Renders ``SYSTEM USER: <image>\\nquestion ASSISTANT: answer</s>USER: ... ASSISTANT:``.
Content may be a plain string or an OpenAI-style list of parts; image parts
(``image``, ``image_url``, ``input_image``) become ``<image>\\n`` where they stand,
consecutive text parts are joined with a space. ``<s>`` is not in the template:
the tokenizer adds it, as llava-hf's does.
"""

LLAVA_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set parts = [{'type': 'text', 'text': message['content']}] -%}"
    "{%- else -%}"
    "{%- set parts = message['content'] -%}"
    "{%- endif -%}"
    "{%- if message['role'] != 'system' -%}{{ message['role'] | upper }}: {% endif -%}"
    "{%- for part in parts -%}"
    "{%- if part['type'] in ['image', 'image_url', 'input_image'] -%}{{ '<image>\n' }}"
    "{%- elif part['type'] == 'text' -%}"
    "{%- if not loop.first and loop.previtem['type'] == 'text' %} {% endif -%}"
    "{{ part['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if message['role'] == 'assistant' -%}{{ '</s>' }}{%- else %} {% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'ASSISTANT:' }}{%- endif -%}"
)

# Qwen2-VL's ChatML: ``<|im_start|>role\ncontent<|im_end|>\n`` per message, a default
# system turn when the conversation has none, and each image as
# ``<|vision_start|><|image_pad|><|vision_end|>`` where it stands (the processor
# then repeats ``<|image_pad|>`` once per image token), each video likewise with
# ``<|video_pad|>``. Text parts are joined as is.
QWEN_VL_CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] in ['image', 'image_url', 'input_image'] -%}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] in ['video', 'video_url'] -%}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

# Qwen3-VL's ChatML: as Qwen2-VL's, without the default system turn (Qwen3-VL's
# template writes a system turn only when the conversation has one).
QWEN3_VL_CHAT_TEMPLATE = QWEN_VL_CHAT_TEMPLATE.removeprefix(
    "{%- if messages and messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{%- endif -%}"
)
