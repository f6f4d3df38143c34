// fmt's compiled part (its format-inl.h), built once into the library. Every other source includes
// fmt's headers without FMT_HEADER_ONLY, which compiled this part into each of them: about half of
// a source's compile time on CI's two cores. Debian ships fmt only as a shared library, which the
// binary carried to the GPU machine must not need (that machine has another version).
#include <fmt/format.h>
#include <fmt/format-inl.h>

namespace fmt {
FMT_BEGIN_DETAIL_NAMESPACE
// The templates format.h declares for its callers and defines here: float formatting (dragonbox),
// the locale lookups and the formatting loop, for the character types kiln writes.
template auto dragonbox::to_decimal(float x) noexcept -> dragonbox::decimal_fp<float>;
template auto dragonbox::to_decimal(double x) noexcept -> dragonbox::decimal_fp<double>;
template locale_ref::locale_ref(const std::locale& loc);
template auto locale_ref::get<std::locale>() const -> std::locale;
template auto thousands_sep_impl(locale_ref) -> thousands_sep_result<char>;
template auto thousands_sep_impl(locale_ref) -> thousands_sep_result<wchar_t>;
template auto decimal_point_impl(locale_ref) -> char;
template auto decimal_point_impl(locale_ref) -> wchar_t;
template void vformat_to(buffer<char>&, string_view, basic_format_args<FMT_BUFFER_CONTEXT(char)>, locale_ref);
FMT_END_DETAIL_NAMESPACE
}  // namespace fmt
