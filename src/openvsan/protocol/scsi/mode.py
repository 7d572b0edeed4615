"""Mode parameters: caching, control and informational exceptions pages (SPC-4 7.5, SBC-4 6.5),
MODE SENSE data and MODE SELECT parsing."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from openvsan.protocol.scsi.sense import (
    ASC_INVALID_FIELD_IN_CDB,
    ASC_SAVING_PARAMETERS_NOT_SUPPORTED,
    ILLEGAL_REQUEST,
    ScsiError,
    invalid_field,
    invalid_param,
    param_list_length_error,
)

CACHING = 0x08
CONTROL = 0x0A
INFORMATIONAL_EXCEPTIONS = 0x1C
ALL_PAGES = 0x3F

PC_CURRENT, PC_CHANGEABLE, PC_DEFAULT, PC_SAVED = 0, 1, 2, 3


def _caching(wce: bool) -> bytearray:
    # SBC-4 6.5.5 caching mode page; RCD clear: reads may be served from cache
    page = bytearray(20)
    page[0], page[1] = CACHING, 18
    page[2] = 0x04 if wce else 0
    return page


def _control(swp: bool) -> bytearray:
    # SPC-4 7.5.8 control mode page: QUEUE ALGORITHM MODIFIER 1 (unrestricted reordering), QERR 0,
    # TAS set (aborted tasks of other nexuses get TASK ABORTED status), fixed-format sense (D_SENSE 0)
    page = bytearray(12)
    page[0], page[1] = CONTROL, 10
    page[3] = 0x10
    page[4] = 0x08 if swp else 0
    page[5] = 0x40
    struct.pack_into(">H", page, 8, 0xFFFF)  # BUSY TIMEOUT PERIOD: unlimited
    return page


def _info_exceptions() -> bytearray:
    # SPC-4 7.5.11: DEXCPT set, nothing to report
    page = bytearray(12)
    page[0], page[1] = INFORMATIONAL_EXCEPTIONS, 10
    page[2] = 0x08
    return page


@dataclass
class ModeState:
    """The LU's current mode parameters; MODE SELECT changes them for every I_T nexus (shared)."""

    wce: bool = True
    swp: bool = False
    # which bits MODE SELECT may change, per page (SPC-4 6.11.3 changeable values)
    changeable: dict[int, bytes] = field(default_factory=lambda: {
        CACHING: bytes(_caching(True)[:2]) + b"\x04" + bytes(17),
        CONTROL: bytes(_control(False)[:2]) + b"\x00\x00\x08" + bytes(7),
        INFORMATIONAL_EXCEPTIONS: bytes(_info_exceptions()[:2]) + bytes(10),
    })

    def page(self, code: int, pc: int) -> bytes:
        if pc == PC_CHANGEABLE:
            return self.changeable[code]
        if pc == PC_DEFAULT:
            return bytes({CACHING: _caching(True), CONTROL: _control(False),
                          INFORMATIONAL_EXCEPTIONS: _info_exceptions()}[code])
        return bytes({CACHING: _caching(self.wce), CONTROL: _control(self.swp),
                      INFORMATIONAL_EXCEPTIONS: _info_exceptions()}[code])

    def pages(self, code: int, subpage: int, pc: int) -> bytes:
        if subpage not in (0, 0xFF):  # no subpages beyond 0 here; FFh asks for all of them
            raise invalid_field(3)
        if code == ALL_PAGES:
            return b"".join(self.page(c, pc) for c in (CACHING, CONTROL, INFORMATIONAL_EXCEPTIONS))
        if code not in (CACHING, CONTROL, INFORMATIONAL_EXCEPTIONS):
            raise invalid_field(2, 5)
        return self.page(code, pc)


def mode_sense(state: ModeState, cdb: bytes, *, ten: bool, write_protect: bool, block_size: int,
               num_blocks: int) -> bytes:
    """MODE SENSE(6)/(10) data (SPC-4 6.13/6.14, header SPC-4 7.5.5, block descriptor SBC-4 6.5.2)."""
    dbd = bool(cdb[1] & 0x08)
    llbaa = ten and bool(cdb[1] & 0x10)
    pc, code, subpage = cdb[2] >> 6, cdb[2] & 0x3F, cdb[3]
    if pc == PC_SAVED:
        raise ScsiError(ILLEGAL_REQUEST, ASC_SAVING_PARAMETERS_NOT_SUPPORTED)
    pages = state.pages(code, subpage, pc)
    # device-specific parameter: WP, DPOFUA (DPO and FUA bits are supported, SBC-4 6.5.1)
    dsp = (0x80 if write_protect else 0) | 0x10
    if dbd:
        desc = b""
    elif llbaa:
        desc = struct.pack(">QII", num_blocks, 0, block_size)
    else:
        desc = struct.pack(">II", min(num_blocks, 0xFFFFFFFF), block_size & 0xFFFFFF)
    if ten:
        header = struct.pack(">HBBBBH", 6 + len(desc) + len(pages), 0, dsp, 0x01 if llbaa else 0, 0, len(desc))
    else:
        header = struct.pack(">BBBB", 3 + len(desc) + len(pages), 0, dsp, len(desc))
    return header + desc + pages


def mode_select(state: ModeState, cdb: bytes, params: bytes, *, ten: bool, block_size: int) -> bool:
    """Apply MODE SELECT(6)/(10) parameters (SPC-4 6.11/6.12); True when a current value changed."""
    if cdb[1] & 0x01:      # SP: we cannot save pages
        raise invalid_field(1, 0)
    if not cdb[1] & 0x10:  # PF clear: vendor-specific page format, which we do not have
        raise invalid_field(1, 4)
    hlen = 8 if ten else 4
    if len(params) < hlen:
        if not params:
            return False
        raise param_list_length_error()
    bdlen = struct.unpack_from(">H", params, 6)[0] if ten else params[3]
    off = hlen
    if bdlen:
        if bdlen not in (8, 16) or len(params) < off + bdlen:
            raise invalid_param(6 if ten else 3)
        # the only block length we take is the current one (SBC-4 6.5.2)
        if struct.unpack_from(">I", params, off + bdlen - 4)[0] & 0xFFFFFF != block_size:
            raise invalid_param(off + bdlen - 3)
        off += bdlen
    wce, swp = state.wce, state.swp
    while off < len(params):
        if len(params) < off + 2:
            raise param_list_length_error()
        code, plen = params[off] & 0x3F, params[off + 1]
        if params[off] & 0x40:  # SPF: no subpages here
            raise invalid_param(off, 6)
        if code not in state.changeable:
            raise invalid_param(off)
        if len(params) < off + 2 + plen:
            raise param_list_length_error()
        page = params[off:off + 2 + plen]
        current = state.page(code, PC_CURRENT)
        mask = state.changeable[code]
        if plen != current[1]:
            raise invalid_param(off + 1)
        for i in range(2, len(page)):
            if (page[i] ^ current[i]) & ~mask[i] & 0xFF:
                raise invalid_param(off + i)
        if code == CACHING:
            wce = bool(page[2] & 0x04)
        elif code == CONTROL:
            swp = bool(page[4] & 0x08)
        off += 2 + plen
    changed = (wce, swp) != (state.wce, state.swp)
    state.wce, state.swp = wce, swp
    return changed


__all__ = ["ASC_INVALID_FIELD_IN_CDB", "ModeState", "mode_select", "mode_sense"]
