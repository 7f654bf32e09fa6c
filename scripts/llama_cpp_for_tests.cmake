# The llama.cpp that pip builds for llama-cpp-python (the `test` extra's GGUF checks), trimmed to
# what the tests load: CMAKE_ARGS="-DCMAKE_PROJECT_INCLUDE=$PWD/scripts/llama_cpp_for_tests.cmake"
# (README, .ci/run). CMake runs this file after each project() call of the build, so it overrides
# what llama-cpp-python's own CMakeLists.txt forces before it adds llama.cpp:
# - no multimodal library (mtmd, which runner never loads);
# - no llama.cpp `common` library (argument parsing, chat and sampling helpers of llama.cpp's own
#   tools, which llama-cpp-python builds but never loads);
# - -O1 instead of -O3: the tests' tiny models do not notice.
# About half the build (two cores: 77 s instead of 146 s; README, "Set up and run").
set(LLAVA_BUILD OFF CACHE BOOL "" FORCE)
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "" FORCE)
set(CMAKE_C_FLAGS_RELEASE "-O1" CACHE STRING "" FORCE)
set(CMAKE_CXX_FLAGS_RELEASE "-O1" CACHE STRING "" FORCE)
