#include "peer_text.h"

#include <cstring>
#include <string_view>

namespace hca {
namespace {

// The length of the well-formed UTF-8 character of two bytes or more at the start of `s`, or 0: the
// ranges of the Unicode standard's table 3-7, which exclude overlong forms, surrogates and code
// points past U+10FFFF, as Python's strict decoder does.
size_t utf8_character(std::string_view s) {
  auto byte = [&](size_t i) { return i < s.size() ? static_cast<unsigned char>(s[i]) : 0u; };
  auto in = [](unsigned b, unsigned lo, unsigned hi) { return b >= lo && b <= hi; };
  const unsigned lead = byte(0), second = byte(1);
  size_t length = 0;
  if (in(lead, 0xC2, 0xDF)) {
    length = in(second, 0x80, 0xBF) ? 2 : 0;
  } else if (in(lead, 0xE0, 0xEF)) {
    const bool ok = lead == 0xE0 ? in(second, 0xA0, 0xBF) : lead == 0xED ? in(second, 0x80, 0x9F)
                                                                         : in(second, 0x80, 0xBF);
    length = ok && in(byte(2), 0x80, 0xBF) ? 3 : 0;
  } else if (in(lead, 0xF0, 0xF4)) {
    const bool ok = lead == 0xF0 ? in(second, 0x90, 0xBF) : lead == 0xF4 ? in(second, 0x80, 0x8F)
                                                                         : in(second, 0x80, 0xBF);
    length = ok && in(byte(2), 0x80, 0xBF) && in(byte(3), 0x80, 0xBF) ? 4 : 0;
  }
  return length;
}

}  // namespace

std::string peer_text(const char* text, size_t capacity) {
  const std::string_view in(text, strnlen(text, capacity));
  std::string out;
  out.reserve(in.size());
  for (size_t i = 0; i < in.size();) {
    const auto c = static_cast<unsigned char>(in[i]);
    const size_t whole = c < 0x80 ? 0 : utf8_character(in.substr(i));
    if (whole) {
      out.append(in.substr(i, whole));
      i += whole;
    } else {
      out += c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?';
      ++i;
    }
  }
  return out;
}

}  // namespace hca
