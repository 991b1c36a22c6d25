"""The vocabularies and sizes the tiny checkpoints share: the byte-level text tokens (id == byte
value, specials from 256), the audio codec's codes and specials, hidden sizes, and the text chat
template (a minimal ChatML: content parts' text concatenated)."""

TEXT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
TEXT_PAD_ID, IM_START_ID, IM_END_ID = 256, 257, 258
TEXT_VOCAB_SIZE = 512  # 259 real tokens rounded up to a multiple of 512 / 64

CODEBOOK_SIZE = 256
CODEC_BOS_ID, CODEC_EOS_ID, CODEC_PAD_ID = 256, 257, 258
CODEC_SPECIAL_TOKENS = ("<|codec_bos|>", "<|codec_eos|>", "<|codec_pad|>")  # ids 256, 257, 258
TALKER_VOCAB_SIZE = 320

THINKER_HIDDEN = 512
TALKER_HIDDEN = 256
MAX_POSITIONS = 32768


CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = namespace(text='') %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}"
    "{%- set content.text = content.text + part['text'] %}{%- endif %}{%- endfor %}"
    "{%- set content = content.text %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
