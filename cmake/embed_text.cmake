# Writes OUTPUT, a C++ source defining `std::string_view NAMESPACE::FUNCTION()` (declared in HEADER)
# that returns the bytes of the text file INPUT. A file the binary serves (the web chat page) thus
# stays an ordinary file in the tree, edited as what it is, and is compiled in at build time:
#   cmake -DINPUT=page.html -DOUTPUT=page.cpp -DHEADER=server/web_chat.h -DNAMESPACE=kiln::server
#         -DFUNCTION=web_chat_page -P cmake/embed_text.cmake
foreach(argument INPUT OUTPUT HEADER NAMESPACE FUNCTION)
  if(NOT DEFINED ${argument})
    message(FATAL_ERROR "embed_text.cmake needs -D${argument}=...")
  endif()
endforeach()
file(READ "${INPUT}" text)
# The text goes into a raw string literal, which ends at the first `)DELIMITER"` (a delimiter has
# at most 16 characters, C++ [lex.string]).
set(delimiter "kiln_embed")
string(FIND "${text}" ")${delimiter}\"" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${INPUT} contains `)${delimiter}\"`, which would end the raw string it is embedded in")
endif()
file(WRITE "${OUTPUT}" "// Generated from ${INPUT} by cmake/embed_text.cmake; edit that file instead.
#include \"${HEADER}\"

namespace ${NAMESPACE} {

std::string_view ${FUNCTION}() {
  static constexpr std::string_view text = R\"${delimiter}(${text})${delimiter}\";
  return text;
}

}  // namespace ${NAMESPACE}
")
