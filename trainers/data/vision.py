"""Rows with images, tokenized and batched by the model's own processor.

A conversation with images renders through the chat template like any other (``trainers.data.chat``):
each image part becomes the family's placeholder in the text (``<start_of_image>``, ``<image>``,
``<|image_pad|>``). Each rendered segment is then tokenized on its own, as text segments are, but one
holding placeholders goes through the processor's own call with its images, in order
(``processor(text=..., images=...)``): the processor expands each placeholder into the image's tokens (as
many as the image processor makes of that image) and returns any per-token input the family has
(Gemma 3's ``token_type_ids``). Image tokens never train: they stand in user and system messages, whose
segments are never trained, and a trained segment with a placeholder is refused.

A batch's pixel inputs (``pixel_values`` and the family's others: ``image_grid_thw``,
``pixel_attention_mask``, ...) come from the processor's own call again, on the batch's image-bearing
segments and their images: the image processor's work happens per batch, from the images kept on disk
(``ImageFiles``), and the token ids of those segments are already the example's.

Truncation never splits an image-bearing segment: a cut inside one moves to its start, which leaves
that segment's images and every later one out; an example left with no trained token is dropped as
any other. Packing is refused for images (``trainers.methods.sft``): the families' rope positions and
image masks are per row.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import tempfile
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError
from transformers.processing_utils import ProcessorMixin

from trainers.chat.images import parse_data_url, url_kind
from trainers.chat.rows import ImageRef
from trainers.data.chat import ChatDataError, Segment
from trainers.data.sft import TokenizedExample

INDEX_FILE = "index.json"
"""In a run's ``images_dir``: ``{url: file name}`` of the images the service fetched at upload."""


class ImageFiles:
    """A run's images on local disk, each stored once by its sha256 in a temporary folder (removed with
    this object): a ``data:`` URL's bytes decoded, an ``http(s)`` URL's taken from ``fetched_dir``, the
    folder of the images the service fetched at upload (``INDEX_FILE``). Nothing is fetched here."""

    def __init__(self, fetched_dir: str | Path | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="images-")
        weakref.finalize(self, self._tmp.cleanup)
        self.root = Path(self._tmp.name)
        self._fetched = Path(fetched_dir) if fetched_dir is not None else None
        index = self._fetched / INDEX_FILE if self._fetched is not None else None
        self._index: dict[str, str] = (
            json.loads(index.read_text(encoding="utf-8")) if index is not None and index.is_file() else {}
        )
        self._known: set[str] = set()

    def add(self, ref: ImageRef) -> str:
        """The key of ``ref``'s image (its sha256), stored if new; ``ChatDataError`` naming the part's URL
        when its bytes are not there or not an image."""
        field = f"{ref.path}.image_url.url"
        if url_kind(ref.url) == "data":
            try:
                data = base64.b64decode(parse_data_url(ref.url)[1], validate=False)
            except (ValueError, binascii.Error) as exc:
                raise ChatDataError(field, f"not a base64 data URL of an image ({exc})") from exc
        else:
            name = self._index.get(ref.url)
            if name is None or self._fetched is None:
                raise ChatDataError(field, "an http(s) image that was not fetched at upload")
            data = (self._fetched / name).read_bytes()
        key = hashlib.sha256(data).hexdigest()
        if key not in self._known:
            path = self.root / key
            path.write_bytes(data)
            try:
                with Image.open(path) as image:
                    image.load()
            except (UnidentifiedImageError, OSError) as exc:
                path.unlink()
                raise ChatDataError(field, f"not a readable image ({exc})") from exc
            self._known.add(key)
        return key

    def open(self, key: str) -> Image.Image:
        with Image.open(self.root / key) as image:
            image.load()
            return image


@dataclass(frozen=True)
class VisionExample(TokenizedExample):
    """A ``TokenizedExample`` with images: ``token_types`` the processor's per-token input of the family
    (empty where it has none), ``vision`` the image keys (``ImageFiles``) in order and each
    image-bearing segment as ``[start, end, text, images]`` (token span, rendered text, image count)."""

    token_types: list[int]
    vision: dict[str, Any]

    @property
    def images(self) -> list[str]:
        return list(self.vision["images"])

    def truncated(self, max_length: int) -> VisionExample:
        """The first ``max_length`` tokens, or fewer: a cut inside an image-bearing segment moves to its
        start, leaving its images and the later ones out."""
        cut = max_length
        segments = [s for s in self.vision["segments"] if s[0] < cut]
        if segments and segments[-1][1] > cut:
            cut = segments.pop()[0]
        kept = sum(s[3] for s in segments)
        vision = {"images": self.vision["images"][:kept], "segments": segments}
        return VisionExample(self.input_ids[:cut], self.loss_mask[:cut], self.token_types[:cut], vision)


_TEXT_KEYS = ("input_ids", "attention_mask")


class VisionData:
    """The processor of a run's model and its images: tokenizes segments with images, batches pixels."""

    def __init__(
        self, processor: ProcessorMixin, images: ImageFiles, *, image_token_id: int | None = None
    ) -> None:
        self.processor, self.images = processor, images
        # the token the model takes image features at (``trainers.modalities.image_token_id``)
        self.image_token_id = image_token_id
        self.tokenizer = processor.tokenizer
        self.placeholder: str = processor.image_token  # type: ignore[attr-defined]
        self.token_type_key: str | None = None  # learnt from the processor's first answer
        self.token_keys: set[str] = set(_TEXT_KEYS)  # what it answers per token

    @property
    def example_type(self) -> type[TokenizedExample]:
        return VisionExample

    def _call(self, texts: list[str], images: list[list[Image.Image]], **kwargs: Any) -> dict[str, Any]:
        out = self.processor(text=texts, images=images, add_special_tokens=False, **kwargs)
        return dict(out)

    def tokenize(self, segments: list[Segment], refs: Sequence[ImageRef]) -> VisionExample:
        """The segments' ids and loss mask, each placeholder expanded by the processor with the next of
        ``refs``' images (in order); ``ChatDataError`` naming the image that does not fit."""
        ids: list[int] = []
        mask: list[bool] = []
        types: list[int] = []
        keys: list[str] = []
        spans: list[list[Any]] = []
        for text, trainable in segments:
            if not text:
                continue
            n = text.count(self.placeholder)
            if n == 0:
                piece = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                kinds = [0] * len(piece)
            else:
                if trainable:  # only assistant turns train, and they hold no image
                    raise ChatDataError(
                        None, f"a trained turn holds the image placeholder {self.placeholder!r}"
                    )
                if len(keys) + n > len(refs):
                    raise ChatDataError(
                        None,
                        f"the text holds the model's image placeholder {self.placeholder!r} more often than "
                        "the row has images",
                    )
                new = [self.images.add(ref) for ref in refs[len(keys) : len(keys) + n]]
                out = self._call([text], [[self.images.open(k) for k in new]])
                piece = list(out["input_ids"][0])
                kinds = self._token_types(out, len(piece))
                spans.append([len(ids), len(ids) + len(piece), text, n])
                keys += new
            ids += piece
            mask += [trainable] * len(piece)
            types += kinds
        if len(keys) != len(refs):
            raise ChatDataError(
                refs[len(keys)].path,
                "the model's chat template does not render this image (no placeholder for it)",
            )
        if mask:
            mask[0] = False
        return VisionExample(ids, mask, types, {"images": keys, "segments": spans})

    def _token_types(self, out: dict[str, Any], n: int) -> list[int]:
        """The processor's per-token input besides the ids (Gemma 3's ``token_type_ids``), or 0s."""
        extra = [k for k, v in out.items() if k not in _TEXT_KEYS and len(v) == 1 and len(v[0]) == n]
        self.token_keys.update(extra)
        if extra:
            self.token_type_key = extra[0]
            return [int(t) for t in out[extra[0]][0]]
        return [0] * n

    def image_spans(self, example: VisionExample) -> list[tuple[int, int]]:
        """Where each image of ``example`` stands, as (first token, end) of what the processor expands it
        into: each segment's text up to and after the image's placeholder through the processor's own
        call (for the estimate's preview: a few examples)."""
        spans: list[tuple[int, int]] = []
        keys = example.images
        for start, _end, text, n in example.vision["segments"]:
            pieces = text.split(self.placeholder)
            for k in range(n):
                before = self.placeholder.join(pieces[: k + 1])
                first = start + self._length(before, keys[len(spans) - k : len(spans)])
                upto = before + self.placeholder
                spans.append((first, start + self._length(upto, keys[len(spans) - k : len(spans) + 1])))
        return spans

    def _length(self, text: str, keys: Sequence[str]) -> int:
        if not keys:
            return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return len(self._call([text], [[self.images.open(k) for k in keys]])["input_ids"][0])

    def image_tokens(self, example: TokenizedExample) -> int:
        """How many of ``example``'s tokens take image features (``image_token_id``'s)."""
        if self.image_token_id is None or not isinstance(example, VisionExample):
            return 0
        return sum(1 for t in example.input_ids if t == self.image_token_id)

    def batch_inputs(self, examples: Sequence[TokenizedExample], width: int) -> dict[str, torch.Tensor]:
        """The model's inputs beyond ids and attention mask for right-padded rows ``width`` wide: the
        per-token types (0 at padding and in rows without images), and the pixel inputs of every image
        in row order, through the processor's own call on the image-bearing segments."""
        out: dict[str, torch.Tensor] = {}
        if self.token_type_key is not None:
            types = torch.zeros((len(examples), width), dtype=torch.long)
            for row, e in enumerate(examples):
                if isinstance(e, VisionExample) and e.token_types:
                    types[row, : len(e.token_types)] = torch.tensor(e.token_types)
            out[self.token_type_key] = types
        shown = [e for e in examples if isinstance(e, VisionExample) and e.vision["images"]]
        if not shown:
            return out
        texts = ["".join(s[2] for s in e.vision["segments"]) for e in shown]
        images = [[self.images.open(k) for k in e.vision["images"]] for e in shown]
        answer = self._call(texts, images, return_tensors="pt", padding=True)
        for key, value in answer.items():
            if isinstance(value, torch.Tensor) and key not in self.token_keys:
                out[key] = value
        return out
